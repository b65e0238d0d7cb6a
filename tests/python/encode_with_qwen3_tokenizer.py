"""Build Qwen3's tokenizer.json with transformers from the fixture vocabulary, merges and
tokenizer_config.json, and encode texts with it (the reference for our tokenizer).

Usage: python encode_with_qwen3_tokenizer.py MODEL_DIR TEXTS_JSON OUT_JSON
Writes MODEL_DIR/tokenizer.json (and tokenizer_config.json); OUT_JSON is a list of id lists.
"""

import json
import os
import shutil
import sys
import tempfile

from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "fixtures"))


def main():
    model_dir, texts_path, out_path = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as src:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(FIXTURES, "qwen3_0.6b_tokenizer", name), os.path.join(src, name))
        shutil.copy(os.path.join(FIXTURES, "qwen3_tokenizer_config.json"), os.path.join(src, "tokenizer_config.json"))
        tok = AutoTokenizer.from_pretrained(src)
        tok.save_pretrained(model_dir)
    with open(texts_path) as f:
        texts = json.load(f)
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    with open(out_path, "w") as f:
        json.dump(ids, f)


if __name__ == "__main__":
    main()
