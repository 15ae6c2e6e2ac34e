

def test_an_adlfs_option_obstore_cannot_honour_is_refused_naming_it_and_the_url() -> None:
    url = "az://container/ckpt"
    with pytest.raises(InvalidURLError) as raised:
        resolve(url, {"transport": "obstore", "account_name": "a", "default_fill_cache": False})
    assert "default_fill_cache" in str(raised.value) and url in str(raised.value)


def test_an_azure_connection_string_reaches_obstore_without_its_key_in_the_refusal() -> None:
    text = "AccountName=acct;AccountKey=c2VjcmV0LWtleQ==;QueueEndpoint=http://127.0.0.1:1/acct"
    with pytest.raises(InvalidURLError) as raised:
        resolve("az://container/ckpt", {"transport": "obstore", "connection_string": text})
    assert "QueueEndpoint" in str(raised.value) and "c2VjcmV0LWtleQ" not in str(raised.value)
