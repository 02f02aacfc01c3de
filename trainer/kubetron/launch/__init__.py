"""`python -m kubetron.launch`: the pod's command (see `__main__`)."""
