"""Model factory (timm)."""
