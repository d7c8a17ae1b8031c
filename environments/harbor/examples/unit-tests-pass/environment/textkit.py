def slugify(text):
    return text.lower().replace(" ", "-")
