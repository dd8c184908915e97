"""The model zoo: the architectures people train, built from configs or by hand (no downloads), with their data."""
