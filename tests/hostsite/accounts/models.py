"""The host site's own user model: the apps must never assume django.contrib.auth's User."""

from django.contrib.auth.models import AbstractUser
from django.db import models


class User(AbstractUser):
    display_name = models.CharField(max_length=100, blank=True)
