"""Chat message validation shared by the offline API (check_messages) and the server's schema."""
import pytest

from kvserve.tokenizer.chat_messages import check_messages


@pytest.mark.parametrize("messages,where", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], "messages[1].role"),
    (["hello"], "messages[0]"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content part 0"),
    ([], "messages"),
])
def test_invalid_messages_name_the_field(messages, where):
    with pytest.raises(ValueError) as e:
        check_messages(messages)
    assert str(e.value).startswith(where)


def test_text_parts_are_joined_and_null_assistant_content_allowed():
    out = check_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None}])
    assert [m["content"] for m in out] == ["a\nb", ""]   # joined with "\n", as vLLM joins them ("ab" had run on)
