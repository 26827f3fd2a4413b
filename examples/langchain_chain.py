"""A LangChain chain decoded by self-speculation: LCEL, streaming, a tool call, structured output.

Everything runs offline on the demo model bundled with selfspec, through ``ChatSpeculative``
(``pip install -e integrations/langchain-selfspec``).

Run::

    HF_HUB_OFFLINE=1 python examples/langchain_chain.py
    HF_HUB_OFFLINE=1 python examples/langchain_chain.py --question "Who is Mr. Darcy?" --compare

``--compare`` answers again with plain decoding (``drafter="none"``): the text is identical, only
the speed differs.
"""

from __future__ import annotations

import argparse
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from langchain_selfspec import ChatSpeculative
from pydantic import BaseModel, Field


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "It's sunny."


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="selfspec-demo", help="hub id, folder, or selfspec-demo")
    parser.add_argument("--question", default="Tell me about Elizabeth Bennet.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--compare", action="store_true", help="also answer with plain decoding")
    args = parser.parse_args()

    llm = ChatSpeculative(model=args.model, max_tokens=args.max_tokens)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You are a helpful assistant."), ("human", "{question}")]
    )
    chain = prompt | llm | StrOutputParser()
    llm.get_engine()  # load the weights now, so that the timings below are decoding only

    print("== LCEL chain: prompt | ChatSpeculative | StrOutputParser")
    started = time.perf_counter()
    answer = chain.invoke({"question": args.question})
    print(answer)
    print(f"({time.perf_counter() - started:.2f}s)")

    print("\n== streaming the same chain")
    for piece in chain.stream({"question": args.question}):
        print(piece, end="", flush=True)
    print()

    message = (prompt | llm).invoke({"question": args.question})
    meta = message.response_metadata
    print(
        f"\nusage {message.usage_metadata}\n"
        f"finish_reason={meta['finish_reason']} mean_accepted_length={meta['mean_accepted_length']:.2f} "
        f"acceptance_rate={meta['acceptance_rate']:.2f} tokens_per_second={meta['tokens_per_second']:.1f}"
    )

    print("\n== tool calling")
    llm_with_tools = llm.bind_tools([get_weather])
    question = "What is the weather in San Francisco, CA?"
    call = llm_with_tools.invoke(question)
    print("tool calls:", call.tool_calls)
    if call.tool_calls:
        result = get_weather.invoke(call.tool_calls[0])
        print("answer:", llm_with_tools.invoke([("human", question), call, result]).content)

    print("\n== structured output (constrained decoding)")
    print(llm.with_structured_output(Joke).invoke("Tell me a joke about cats."))

    if args.compare:
        plain = ChatSpeculative(model=args.model, max_tokens=args.max_tokens, drafter="none")
        started = time.perf_counter()
        plain_answer = (prompt | plain | StrOutputParser()).invoke({"question": args.question})
        print(f"\n== plain decoding ({time.perf_counter() - started:.2f}s): identical text: {plain_answer == answer}")


if __name__ == "__main__":
    main()
