"""Keyset pages over (created_at, id), newest first by default: OpenAI's `after` cursor is the last id seen."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, or_


def keyset_page(query: Select[Any], model: Any, cursor: Any | None, *, descending: bool, limit: int) -> Select[Any]:
    """`query` narrowed to the rows after `cursor` (a row of `model`, or None for the first page), ordered,
    one row more than `limit` (its presence says there is another page)."""
    if cursor is not None:
        created_at, row_id = cursor.created_at, cursor.id
        if descending:
            query = query.where(or_(model.created_at < created_at, (model.created_at == created_at) & (model.id < row_id)))
        else:
            query = query.where(or_(model.created_at > created_at, (model.created_at == created_at) & (model.id > row_id)))
    order = (model.created_at.desc(), model.id.desc()) if descending else (model.created_at, model.id)
    return query.order_by(*order).limit(limit + 1)
