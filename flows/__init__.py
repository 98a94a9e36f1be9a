"""Prefect flows of SAGE Studio: `sage-train`, `sage-eval`, `hint-study` (see flows/serve.py and prefect.yaml).

Import the flows from their modules (flows.train_flow, flows.eval_flow, flows.study_flow); this package
imports nothing so `python -m flows.serve` and `prefect deploy` stay light.
"""
