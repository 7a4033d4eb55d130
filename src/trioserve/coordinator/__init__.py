"""The DP coordinator (``trioserve::DPCoordinator``): collects every engine core's load and publishes it
to every API server. ``core`` is the pure publication rule, ``main`` the Trio shell and process main."""
