"""Small helpers every layer may use and that use no other part of moe_lab: config errors, the runtime device and
dtype, the config tree's location, reading device values to the host without a stall, and the mode of files left for
others to read."""
