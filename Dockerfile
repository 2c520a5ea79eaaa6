FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY chat ./chat
COPY recovery ./recovery
# The apps plus the demo site's extras (daphne, WhiteNoise, the scripted model).
RUN pip install -c requirements.lock ".[demo]"
COPY . .
RUN DJANGO_SECRET_KEY=collectstatic python manage.py collectstatic --noinput
EXPOSE 8000 8765
