"""DeepSpeed: its record, Manager, and the trainer behind ``prepare`` on DeepSpeed's engine with the pieces only
it uses: config translation, checkpoint layout, stage-0 reducer and the agreed loss scaler."""
