"""The worker: device, memory sizing, and the model runner that executes scheduler steps."""
