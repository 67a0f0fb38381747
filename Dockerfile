# CPU image of the icr service.
#   docker build -t icr .
#   docker run --rm -p 8000:8000 -v icr-data:/artifacts icr demo --workdir /artifacts --host 0.0.0.0
#   docker run --rm -p 8000:8000 -v /srv/icr:/artifacts -e ICR_API_KEY=secret icr      # serve built artifacts
# GPU variant: Dockerfile.gpu.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /app

# Dependencies first, in their own layer: editing the code does not reinstall torch. The package
# folders are empty placeholders here so pip can resolve the project's dependencies.
COPY pyproject.toml setup.py README.md ./
RUN mkdir -p icr core training index service \
 && touch icr/__init__.py core/__init__.py training/__init__.py index/__init__.py service/__init__.py \
 && pip install --extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install . \
 && pip uninstall -y icr \
 && rm -rf icr core training index service build *.egg-info

# The code.
COPY icr icr
COPY core core
COPY training training
COPY index index
COPY service service
RUN pip install --no-deps . && rm -rf build *.egg-info

RUN useradd --create-home --uid 1000 icr && mkdir /artifacts && chown icr /artifacts
USER icr
VOLUME /artifacts
ENV ICR_INDEX=/artifacts/index/images \
    ICR_CAPTION_INDEX=/artifacts/index/captions \
    ICR_JOBS_DB=/artifacts/jobs.sqlite \
    ICR_HOST=0.0.0.0 \
    ICR_PORT=8000
EXPOSE 8000
# Bound to every interface: put a reverse proxy (nginx, a cloud load balancer) in front of a port that
# leaves the host; icr serve bounds slow clients itself (ICR_HEADER_TIMEOUT_SECONDS,
# ICR_BODY_TIMEOUT_SECONDS, ICR_MAX_CONNECTIONS) and each peer address's connections
# (ICR_MAX_CONNECTIONS_PER_CLIENT, 64): behind a proxy every client is the proxy, so raise that above
# the proxy's upstream connections (or set 0) and let the proxy bound clients. The health check sends
# ICR_API_KEY, which /readyz needs with ICR_HEALTH_NEED_KEY=true.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
  CMD python -c "import os, urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:8000/readyz', headers={'X-API-Key': os.environ.get('ICR_API_KEY', '')}), timeout=4)"
ENTRYPOINT ["icr"]
CMD ["serve"]
