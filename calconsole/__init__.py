"""calconsole: terminal operations console for the (simulated) Calculet dual-chiplet NPU."""

__version__ = "0.1.0"
