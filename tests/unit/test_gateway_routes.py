"""The gateway's routes, defined one module per API surface and inherited by `Gateway`, are all the
replica's: none is left with a `self` that a client would have to send."""

from raylane.deployments.gateway.ingress import app

PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/v1/responses",
    "/v1/responses/{response_id}",
    "/v1/files",
    "/v1/files/{file_id}",
    "/v1/files/{file_id}/content",
    "/v1/batches",
    "/v1/batches/{batch_id}",
    "/v1/batches/{batch_id}/cancel",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/models",
    "/v1/models/{model_id}",
    "/health",
    "/metrics",
]


def test_every_surface_is_in_the_openapi_document_and_bound_to_the_gateway():
    document = app.openapi()
    assert list(document["paths"]) == PATHS
    operations = [op for path in document["paths"].values() for op in path.values()]
    assert len(operations) == 23
    assert all(p["name"] != "self" for op in operations for p in op.get("parameters", []))
