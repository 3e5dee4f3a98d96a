"""The gateway's API, one module per surface: each holds an `APIRouter` and the mixin class whose
methods are its routes; `Gateway` (deployments/gateway/ingress.py) inherits them all."""
