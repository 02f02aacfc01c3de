"""`python -m kubetron.launch`: the pod's command, which the operator's pods and the trainer image's entry point
run. It keeps this name for pods made by operators of any version; the launcher is kubetron.supervisor.launch."""

from kubetron.supervisor.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
