"""Planning a training configuration before it runs: ``python -m moe_lab.plan`` (memory and step time per GPU on a
hardware profile's mesh, ``planner``), ``python -m moe_lab.plan.calibrate`` (a hardware profile measured on this
machine's GPU). Nothing here builds a model or touches a GPU, but the calibration."""
