"""The supervisor's decision core: report batches in, journaled decisions and commands out.

No Ray and no torch here: `control.Controller` validates what the ranks
report (`report_validation`), asks the policy engine, journals each decision
before it goes out and resolves it from the ranks' outcomes;
`control_state` is its state record in `journal.wal` and the replay of the
records after it. The Ray actor (`supervisor.actor`) feeds it; a Guard
without a supervisor (the single-process mode) drives one directly.
"""
