"""The gateway process: the FastAPI ingress and what it runs per request (rate limits, routing,
dispatch and fallback, the SSE relay, resumption, conversation affinity, pool health, stored
responses, embeddings). It reaches the engine only through `raylane.deployments.protocol`."""
