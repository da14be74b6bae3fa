"""What the ranks of a job agree on and how a run ends: :mod:`.same_job` before the first
step, :mod:`.agreement` (over :mod:`.exchange`) after every step, with the shares of
:mod:`.rebalance`, and :mod:`.liveness` for SIGTERM and peers that stop."""
