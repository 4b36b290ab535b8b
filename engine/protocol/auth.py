"""The admin bearer token's contract between the operator and the engine: where the engine finds it."""

# A file holding the token (the operator mounts the rollout's Secret there); `pdrollout serve
# --admin-token-file` defaults to it.
ADMIN_TOKEN_FILE_ENV = "PDROLLOUT_ADMIN_TOKEN_FILE"
