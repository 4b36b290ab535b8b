# The pdrollout engine on top of an SGLang release image, which already carries CUDA, PyTorch, DeepEP
# and NVSHMEM built against each other; we add only our package and its pure-Python needs.
#   docker build -f images/engine.Dockerfile -t ghcr.io/pdrollout/engine:0.1.0 .
# Pinned by tag here; pin the digest (lmsysorg/sglang:TAG@sha256:...) when publishing.
FROM lmsysorg/sglang:v0.5.12-cu130

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/pdrollout
COPY pyproject.toml ./
COPY engine ./engine
COPY operator ./operator
# --no-deps: keep the base image's torch/CUDA stack exactly as built; add only what it lacks.
RUN pip install --no-cache-dir "aiohttp==3.14.5" "prometheus-client==0.26.0" "pydantic==2.14.4" \
    && pip install --no-cache-dir --no-deps . \
    && python -c "import deep_ep, torch; print('torch', torch.__version__)"

EXPOSE 30000 29500
ENTRYPOINT ["pdrollout"]
CMD ["serve", "--help"]
