"""Measurements the offload planner plans with: per-block costs traced on the meta device
(`tracing`), the machine's rates (`hardware`), real blocks and steps timed on the device
(`calibration`), and the one timer they share (`timer`)."""
