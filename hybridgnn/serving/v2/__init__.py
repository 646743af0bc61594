"""The KServe v2 service, transport-neutral: request and answer types, validation,
metadata and configuration, statistics, repository operations, inference and updates."""
