"""Small fixed word and phrase banks for the synthetic chat and tool-use mix."""

from __future__ import annotations

# fmt: off
ASCII_WORDS = (
    "apple", "river", "candle", "quartz", "meadow", "violet", "lantern", "harbour", "pepper",
    "saddle", "orchard", "thimble", "ribbon", "falcon", "marble", "walnut", "biscuit", "compass",
    "shilling", "bonnet", "carriage", "parsonage", "letter", "garden", "piano", "teapot",
)
NON_ASCII_WORDS = (
    "café", "naïve", "crème brûlée", "señor", "jalapeño", "façade", "résumé", "über", "Straße",
    "Ångström", "piñata", "déjà vu", "smörgåsbord", "Mädchen", "garçon", "fiancée", "Brontë",
    "東京", "日本", "ありがとう", "北京", "Москва", "Ελλάδα", "naïveté", "Björk", "Chloë",
)
CITIES = (
    "London", "Paris", "Bath", "Brighton", "Zürich", "München", "São Paulo", "Kraków", "東京",
    "Reykjavík", "Genève", "Málaga", "Göteborg", "Łódź", "Tokyo", "Berlin", "Madrid", "Rome",
    "New York", "San Francisco, CA", "Oslo", "Lisbon", "Dublin", "Edinburgh", "Besançon", "大阪",
)
CHARACTERS = (
    "Emma", "Harriet", "Mr. Knightley", "Mr. Woodhouse", "Miss Bates", "Jane Fairfax",
    "Frank Churchill", "Elizabeth", "Mr. Darcy", "Jane", "Mr. Bingley", "Lydia", "Mrs. Bennet",
    "Mr. Collins", "Lady Catherine", "Anne", "Captain Wentworth", "Sir Walter", "Fanny",
    "Edmund", "Mrs. Norris", "Henry Crawford", "Catherine", "Mr. Tilney", "Elinor",
    "Marianne", "Willoughby", "Colonel Brandon", "Edward", "Lucy",
)
FACTS = (
    (("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"),
     "Pride and Prejudice was written by Jane Austen and first published in 1813."),
    (("When was Emma published?", "What year did Emma come out?"),
     "Emma was first published in 1815, the last novel Jane Austen saw in print."),
    (("Who wrote Sense and Sensibility?",),
     "Sense and Sensibility was written by Jane Austen and published in 1811."),
    (("Which Austen novels were published after her death?",),
     "Northanger Abbey and Persuasion were published together in 1817, after her death."),
    (("Who is Emma Woodhouse?",),
     "Emma Woodhouse is the heroine of Emma: handsome, clever, and rich, with a comfortable "
     "home and happy disposition."),
    (("Who is Mr. Darcy?",),
     "Mr. Darcy is the proud and wealthy master of Pemberley, who at last wins Elizabeth Bennet."),
    (("Who is Anne Elliot?",),
     "Anne Elliot is the heroine of Persuasion, who was persuaded to give up Captain Wentworth."),
    (("Who is Fanny Price?",), "Fanny Price is the quiet and steady heroine of Mansfield Park."),
    (("Who is Catherine Morland?",),
     "Catherine Morland is the young heroine of Northanger Abbey, very fond of novels."),
    (("Who are Elinor and Marianne?",),
     "Elinor and Marianne Dashwood are the sisters of Sense and Sensibility: the one all "
     "sense, the other all sensibility."),
    (("What is the capital of France?",), "The capital of France is Paris."),
    (("What is the capital of Japan?",), "The capital of Japan is Tokyo (東京)."),
    (("What is the capital of Switzerland?",), "The capital of Switzerland is Bern."),
    (("What is the capital of England?",), "The capital of England is London."),
    (("What is the capital of Germany?",), "The capital of Germany is Berlin."),
    (("How many days are there in a week?",), "There are seven days in a week."),
    (("What colour is the sky?",), "On a fine day the sky is blue."),
    (("What do you call a young cat?",), "A young cat is called a kitten."),
    (("What day comes after Monday?",), "Tuesday comes after Monday."),
    (("Can you help me?", "I need some help."),
     "Certainly; I shall be very happy to help you. What do you need?"),
    (("Who are you?", "What are you?"),
     "I am a small language model, trained on the novels of Jane Austen, at your service."),
    (("Thank you!", "Thanks a lot."), "You are very welcome."),
    (("Goodbye!", "Bye."), "Goodbye! It has been a pleasure."),
)
GREETINGS = (
    ("Hello!", "Hello! How may I be of service to you today?"),
    ("Hi", "Hi! What can I do for you?"),
    ("Hi there.", "Hello there! How can I help you?"),
    ("hello", "Hello! How can I help you today?"),
    ("Good morning.", "Good morning! I hope you are very well. How may I help you?"),
    ("Good evening!", "Good evening! What may I do for you?"),
    ("Hey, how are you?", "I am very well, thank you. How are you?"),
    ("How do you do?", "How do you do? It is a pleasure to hear from you."),
    ("how are you", "Very well, I thank you. And you?"),
    ("Bonjour !", "Bonjour ! How may I help you today?"),
    ("Guten Tag!", "Guten Tag! How can I help you?"),
    ("こんにちは", "こんにちは! How may I help you?"),
    ("¡Hola!", "¡Hola! What can I do for you?"),
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant who writes in the style of Jane Austen.",
    "Answer briefly.",
    "You are a courteous and accurate assistant.",
    "You are a helpful assistant. Keep your answers short.",
)
TRANSLATIONS = (
    ("French", "good morning", "bonjour"),
    ("French", "thank you very much", "merci beaucoup"),
    ("French", "the weather is fine", "il fait beau"),
    ("French", "where is the library?", "où est la bibliothèque ?"),
    ("French", "I love reading", "j'aime lire"),
    ("French", "a cup of coffee", "une tasse de café"),
    ("German", "good morning", "Guten Morgen"),
    ("German", "thank you", "danke schön"),
    ("German", "the house is big", "das Haus ist groß"),
    ("German", "the girl reads a book", "das Mädchen liest ein Buch"),
    ("Spanish", "good night", "buenas noches"),
    ("Spanish", "how are you?", "¿cómo estás?"),
    ("Spanish", "the coffee is hot", "el café está caliente"),
    ("Spanish", "the year", "el año"),
    ("Japanese", "hello", "こんにちは"),
    ("Japanese", "thank you", "ありがとう"),
    ("Japanese", "Tokyo", "東京"),
    ("Japanese", "Japan", "日本"),
)
JOKES = (
    ("cats", "Why did the cat sit on the computer?", "To keep an eye on the mouse!"),
    ("cats", "What do you call a pile of cats?", "A meowtain."),
    ("cats", "Why are cats good at video games?", "Because they have nine lives."),
    ("dogs", "Why did the dog sit in the shade?", "Because he did not want to be a hot dog."),
    ("fish", "Why are fish so smart?", "Because they live in schools."),
    ("bears", "What do you call a bear with no teeth?", "A gummy bear."),
    ("cows", "Where do cows go for entertainment?", "To the moo-vies."),
    ("ducks", "What time does a duck wake up?", "At the quack of dawn."),
    ("books", "Why was the book so cold?", "It had lost its jacket."),
    ("owls", "What do owls say on Halloween?", "Happy Owl-ween!"),
    ("horses", "Why did the horse cross the road?", "To visit its neigh-bours."),
    ("tea", "Why did the teapot blush?", "Because it saw the sugar bowl."),
    ("Mr. Darcy", "Why did Mr. Darcy refuse to dance?", "He was too proud to step on anyone's toes."),
    ("balls", "Why did Mr. Collins go to the ball?", "To give a very long speech to the punch bowl."),
)
DEFINITIONS = {
    "amiable": "friendly and pleasant in manner",
    "prudent": "acting with care and thought for the future",
    "sensibility": "the ability to feel deeply",
    "candour": "the quality of being open and honest",
    "felicity": "intense happiness",
    "civility": "formal politeness and courtesy",
    "café": "a small restaurant selling light meals and drinks",
    "naïve": "showing a lack of experience or judgement",
    "façade": "the front of a building",
    "vexation": "the state of being annoyed or worried",
}
WEATHER = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "stormy")
TOOL_VERBS = (
    "get", "set", "compute", "find", "fetch", "make", "check", "run", "list", "update",
    "frob", "zap", "blend", "scan", "count", "measure", "toggle", "resolve",
)
TOOL_NOUNS = (
    "widget", "score", "value", "record", "glimmer", "token", "level", "item", "flux", "sprocket",
    "report", "entry", "gizmo", "baz", "foo", "quux", "ratio", "total", "signal", "ledger",
)
SYLLABLES = ("zor", "bla", "quin", "tel", "mar", "vex", "lo", "pri", "dax", "fen", "ul", "gri")
PARAM_NAMES = (
    "x", "y", "n", "count", "value", "name", "word", "city", "flag", "enabled", "amount", "rate",
    "label", "id", "size", "level", "text", "query", "input", "limit", "verbose", "threshold",
    "color", "mode", "a", "b", "factor", "title", "strict", "year",
)
ROOMS = ("kitchen", "drawing room", "library", "bedroom", "hall", "garden room")
TOPICS = ("marriage", "balls", "letters", "gardens", "music", "Bath", "the navy", "novels")
# fmt: on
