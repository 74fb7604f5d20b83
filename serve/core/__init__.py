"""The engine's jobs that are not the device's: requests, scheduling, call inputs, outputs."""
