"""``deepspeed.runtime``: the package of ``deepspeed.runtime.engine`` (the lead's runtime/engine.py), so
``from deepspeed.runtime.engine import DeepSpeedEngine`` maps with only the import line changed."""
