"""The answer lengths records run where the user sets none, and the times a sweep repeats each point, in one place for
the command line and the window (a light module: the command line reads them before it imports the engine)."""

# a scenario's for a model that answers at once (one that reasons first has its own: scenario_answer_tokens):
# `record`'s and `contention`'s, the window's Record's and contention test's
SCENARIO_TOKENS = 64
# a sweep's for every model (engine/records/sweep.reasoning_length_note)
SWEEP_TOKENS = 32
# the times a sweep runs each point's scenarios: a median of 3 is not moved by one run slowed by something else
SWEEP_REPEATS = 3
