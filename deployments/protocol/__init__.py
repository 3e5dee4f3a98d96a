"""What the gateway and the pools share: OpenAI request and response schemas, the items that cross
the gateway <-> pool handle (`wire`), OpenAI errors, sampling parameters from a request, and the
tool-call markup both sides read."""
