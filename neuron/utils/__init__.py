"""Helpers with no neuron dependencies: logging set-up and Linux process state."""
