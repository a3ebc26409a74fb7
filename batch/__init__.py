"""The OpenAI Batch API's durable state: uploaded files, batches and their lines,
claimed by gateway processes with expiring leases (docs/architecture.md, "Batches").

Imports only :mod:`config`; the HTTP endpoints and the runner that feeds lines
through the request pipeline live in :mod:`gateway.batch_api` and
:mod:`gateway.batch_runner`.
"""
