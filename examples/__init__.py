"""Examples that run behind opgate: the sample operator lives in ``examples/reconciler``."""
