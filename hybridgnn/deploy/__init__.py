"""Deployment tooling: load-balancer configs (HAProxy, nginx) and the local cluster
supervisor behind `hybridgnn cluster`. Not part of the serving process."""
