# One image for every service (gateway, workers); the command picks the role.
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY lang_client ./lang_client
# The CUDA 13 build of torch and Triton on GPU hosts (the CPU pin in pyproject is for CPU machines), then
# the rest of pyproject's dependencies, ucxx-cu13 included (KV pages between PD workers; CUDA 13 to match).
RUN pip install --no-cache-dir torch==2.11.0 triton==3.6.0 --index-url https://download.pytorch.org/whl/cu130 \
    && pip install --no-cache-dir --no-deps -e . \
    && pip install --no-cache-dir aiohttp==3.14.5 msgpack==1.2.4 safetensors==0.8.0 tokenizers==0.23.3 \
       jinja2==3.1.6 prometheus-client==0.26.0 redis==8.1.0 huggingface-hub==2.4.0 xgrammar==0.2.9 transformers==5.24.0 \
       numpy==2.4.6 ucxx-cu13==0.52.0
EXPOSE 30000
CMD ["python", "-m", "services.launch", "--model-path", "tiny-random", "--host", "0.0.0.0", "--port", "30000"]
