# The PDRollout operator: kopf + the kubernetes client, no torch.
#   docker build -f images/operator.Dockerfile -t ghcr.io/pdrollout/operator:0.1.0 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/pdrollout
COPY pyproject.toml ./
COPY engine ./engine
COPY operator ./operator
# --no-deps: the package's own list pulls torch, which the operator never imports.
RUN pip install --no-cache-dir \
        "kopf==1.45.2" "kubernetes==37.0.2" "pydantic==2.14.4" "pyyaml==6.0.3" \
        "prometheus-client==0.26.0" "aiohttp==3.14.5" \
    && pip install --no-cache-dir --no-deps . \
    && python -c "import pdrollout.operator.handlers"

USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["pdrollout-operator"]
CMD ["--liveness=http://0.0.0.0:8080/healthz"]
