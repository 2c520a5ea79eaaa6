FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY chat ./chat
COPY recovery ./recovery
# The apps plus the demo site's extras (daphne, WhiteNoise, the scripted model).
RUN pip install -c requirements.lock ".[demo]"
COPY . .
# A throwaway key: collectstatic signs nothing, and a process with DEBUG off refuses a public key.
RUN DJANGO_SECRET_KEY="$(python -c 'import secrets; print(secrets.token_urlsafe(50))')" \
    python manage.py collectstatic --noinput
EXPOSE 8000 8765
