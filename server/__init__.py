"""sarathi-jax gRPC generation service (see server/README.md)."""
