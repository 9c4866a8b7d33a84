"""The bundled demo model: a tiny Qwen2-VL trained on generated pictures of coloured shapes.

`pictures` draws the pictures, `dialogues` asks and answers questions about them, `folder`
writes the hub-layout model folder, `train` trains it on the CPU and `evaluate` measures it
through mmserve (offline or over the OpenAI API) and against transformers.
"""
