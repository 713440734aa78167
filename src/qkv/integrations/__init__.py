"""Bridges from other libraries to `qkv.attention`.

Each submodule imports its library only when it is used, so `import qkv` stays light:

    import qkv.integrations.hf
    qkv.integrations.hf.register()      # then attn_implementation="qkv" in transformers
"""
