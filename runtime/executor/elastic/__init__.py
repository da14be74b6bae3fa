"""Elastic runs under torchrun's elastic agent: at each (re)start the ranks learn who is
there, take the plan made for those nodes and resume from the newest checkpoint; during the
run they take in nodes that wait to join and re-plan when a rank's speed stays off its plan.
"""
