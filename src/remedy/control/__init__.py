"""The supervisor's decision core: report batches in, journaled decisions and commands out.

No Ray and no torch here: `control.Controller` validates what the ranks
report (`report_validation`), asks the policy engine, puts each decision in
the history and resolves it from the ranks' outcomes; `control_state` is its
part of the state record in `journal.wal` (`record.RunRecord`), which the
shell writes before a reply carries a decision's command. The Ray actor (`supervisor.actor`) feeds it; a Guard
without a supervisor (the single-process mode) drives one directly.
"""
