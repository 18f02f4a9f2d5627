"""Virtual memory management: a device buffer whose base address never moves."""
