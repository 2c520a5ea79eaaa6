"""New rows inserted as the ORM inserts them, without its compile on every call.

On the accept path a `Model.objects.create` spent more on building its statement than on running it
(issue 37). Here a model's columns are listed once, and each call only prepares the values, as
`Model.save` would: every field's default and `pre_save` (`auto_now_add` included), then its
`get_db_prep_save` (a JSON value adapted, say). An auto-incremented key is left to the database.
"""

from __future__ import annotations

import functools
from typing import Any

from django.db import connection, models


def prepared(model: type[models.Model], name: str, value: Any) -> Any:
    """`value` as the ORM would send it for the field `name` of `model`."""
    field = model._meta.get_field(name)
    assert isinstance(field, models.Field)
    return field.get_db_prep_save(value, connection)


def row_insert(instance: models.Model, *, conflict: str = "") -> bool:
    """Insert the new `instance` (made with `Model(...)`, not saved yet), with `conflict` (an `ON CONFLICT
    ... DO NOTHING`) if given, and mark it saved. False when the conflict left nothing inserted."""
    model = type(instance)
    auto, fields, columns = _columns(model)
    values = [field.get_db_prep_save(field.pre_save(instance, True), connection) for field in fields]
    returning = connection.ops.quote_name(auto.column) if auto is not None else "1"
    sql = (
        f"INSERT INTO {connection.ops.quote_name(model._meta.db_table)} ({columns})"
        f" VALUES ({', '.join(['%s'] * len(values))}) {conflict} RETURNING {returning}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return False
    if auto is not None:
        setattr(instance, auto.attname, row[0])
    instance._state.adding, instance._state.db = False, connection.alias
    return True


@functools.cache
def _columns(model: type[models.Model]) -> tuple[Any, list[Any], str]:
    """The model's auto-incremented key (None when it has none), its other concrete fields, their
    quoted columns."""
    auto = next((f for f in model._meta.concrete_fields if getattr(f, "db_returning", False)), None)
    fields = [f for f in model._meta.concrete_fields if f is not auto]
    return auto, fields, ", ".join(connection.ops.quote_name(f.column) for f in fields)
