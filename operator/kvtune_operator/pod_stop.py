"""How an engine pod stops without failing a request, for both runtimes (every restart change is a
rollout that stops the old pods while clients still send to them).

A deleted pod leaves the Service's endpoints while it is told to stop, and the proxies and the
gateway learn of it some time later: requests keep arriving for a few seconds. So the pod first
sleeps (``preStop``, still serving everything), then gets SIGTERM and drains: it takes no new
request and finishes those in flight, for at most ``DRAIN_TIMEOUT_S`` (``kvtune serve`` and
``vllm serve`` both have ``--shutdown-timeout``; vLLM's default 0 aborts them). All of it fits in
the grace period, with room for the process to exit before the SIGKILL.
"""
TERMINATION_GRACE_S = 60
PRESTOP_SLEEP_S = 5
DRAIN_TIMEOUT_S = 50
assert PRESTOP_SLEEP_S + DRAIN_TIMEOUT_S < TERMINATION_GRACE_S
