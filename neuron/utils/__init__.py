"""Helpers with no neuron dependencies: logging set-up, Linux process state, host data to the device."""
