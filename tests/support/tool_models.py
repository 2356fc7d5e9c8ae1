"""Pydantic tool schemas as users pass them (no ``additionalProperties``), and the functions
they call: the engine's grammar tests and the cluster's tool-call tests share them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"] = "celsius"


class Search(BaseModel):
    query: str = Field(max_length=40)
    max_results: int = 5


def get_weather(city: str, unit: str = "celsius") -> str:
    return f"{city}: 20 {unit}"


def search(query: str, max_results: int = 5) -> str:
    return f"{max_results} results for {query}"
