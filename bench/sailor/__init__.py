"""Import of the published Sailor study (profiles, network curves, measured plans) for
``bench/fidelity.py`` and ``bench/study_plans.py``; benchmark code, not part of hplan."""
