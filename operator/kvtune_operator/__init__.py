"""The kvtune operator: InferenceDeployment CRD, reconciliation, and the tuner."""
