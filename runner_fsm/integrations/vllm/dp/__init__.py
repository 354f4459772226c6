"""DP support: what `FSMWorker` installs when a job has more than one data-parallel replica.

`support` (`DPSupport`) ties the parts together; `agreement` carries the replica's agreement rows
inside vLLM's own DP all-reduce (the runner adapter says where that collective is); `watchdog`
ends every rank of a job whose collective never completes; `drafts` checks scheduled drafts
against the drafter's proposals. Nothing here names a model runner's attribute: it asks the
runner's adapter (`runners/`).
"""
