"""Scheduling policy, pure Python (no torch): request state, the StepPlan the
engine carries out, the policies behind one interface, and the simulator."""
