"""Tools that a policy can call during rollouts (e.g. a sandboxed Python interpreter)."""
