"""Plain general-knowledge text for the forgetting probe: short factual paragraphs written for fastkit.

Each paragraph is scored as plain text (no chat template, no question asked), so a model that only learned a new
answer format scores it as it did before, while a model that lost general knowledge or fluency finds it less likely.
The paragraphs cover many everyday subjects on purpose: no fine-tuning set is about all of them.
"""

from __future__ import annotations

GENERAL_TEXT = (
    "Water boils at one hundred degrees Celsius at sea level. On a high mountain the air pressure is lower, so "
    "water boils at a lower temperature and food takes longer to cook.",
    "Paris is the capital of France. The river Seine flows through the city, and the Eiffel Tower, built for a "
    "world fair in 1889, stands on its left bank.",
    "Plants make their own food by photosynthesis. Their leaves take in carbon dioxide from the air and water from "
    "the soil, and use the energy of sunlight to turn them into sugar and oxygen.",
    "The Earth goes around the Sun once a year and turns on its axis once a day. Because the axis is tilted, the "
    "northern and southern halves of the planet have their summers at opposite times of the year.",
    "A week has seven days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. A year usually has "
    "three hundred and sixty-five days, and one more in a leap year.",
    "The heart is a muscle that pumps blood around the body. Blood carries oxygen from the lungs to every cell and "
    "brings carbon dioxide back to be breathed out.",
    "William Shakespeare was an English playwright and poet. He wrote Romeo and Juliet, Hamlet and Macbeth, and his "
    "plays are still performed all over the world.",
    "To make a cup of tea, boil fresh water and pour it over the tea leaves or a tea bag. Let it steep for a few "
    "minutes, then add milk, lemon or sugar if you like.",
    "The Pacific is the largest and deepest ocean on Earth. It lies between Asia and Australia on one side and the "
    "Americas on the other.",
    "Multiplication is repeated addition. Three times four means adding four three times, which gives twelve, and "
    "the order does not matter: four times three is also twelve.",
    "The Moon orbits the Earth about once a month. It gives off no light of its own; we see it because it reflects "
    "the light of the Sun, and its shape seems to change as more or less of its lit side faces us.",
    "Bread is made from flour, water, salt and yeast. The yeast feeds on the sugars in the dough and releases gas, "
    "which makes the bread rise before it is baked in a hot oven.",
    "A computer program is a list of instructions. The computer follows them one after another, and a loop lets it "
    "repeat the same steps many times without writing them out again.",
    "The Amazon rainforest in South America is the largest tropical forest in the world. It is home to millions of "
    "kinds of insects, plants, birds and other animals, and the Amazon river runs through it.",
    "Ice is frozen water. Unlike most substances, water expands when it freezes, which is why ice floats and why "
    "pipes can burst in a cold winter.",
    "The ancient Egyptians built the pyramids at Giza more than four thousand years ago as tombs for their kings. "
    "The largest of them was the tallest building in the world for a very long time.",
    "Sleep helps the body and the brain recover. Most adults need seven to nine hours a night, and going to bed at "
    "the same time every day makes it easier to fall asleep.",
    "Light travels faster than anything else, at about three hundred thousand kilometres per second. Sunlight takes "
    "roughly eight minutes to reach the Earth.",
    "Mount Everest, on the border between Nepal and China, is the highest mountain above sea level. Climbers need "
    "weeks to get used to the thin air before they try to reach the top.",
    "A library lends books to the people who live nearby. You can borrow a book for a few weeks, read it at home "
    "and then bring it back so that someone else can read it.",
    "Bees collect nectar and pollen from flowers. As they fly from one flower to the next they carry pollen with "
    "them, which helps the plants make seeds and fruit.",
    "The primary colours of paint are red, yellow and blue. Mixing two of them gives a secondary colour: yellow and "
    "blue make green, and red and blue make purple.",
    "A thermometer measures temperature. Doctors use one to check whether a person has a fever, which usually means "
    "the body is fighting an infection.",
    "Spanish is spoken by hundreds of millions of people in Spain and in most countries of Central and South "
    "America. Good morning in Spanish is buenos dias.",
    "Rain forms when water vapour in the air cools and condenses into tiny droplets around specks of dust. The "
    "droplets join together in clouds until they are heavy enough to fall.",
    "The piano has black and white keys. Pressing a key makes a small hammer strike a string inside the instrument, "
    "and longer strings give lower notes.",
    "Electric current flows when a circuit is closed. A switch opens or closes the circuit, which is how a lamp is "
    "turned on and off.",
    "Fruit and vegetables are an important part of a healthy diet. They contain vitamins, minerals and fibre, and "
    "doctors advise eating several portions every day.",
    "The Great Wall of China was built over many centuries to protect the northern borders of Chinese states. It "
    "stretches for thousands of kilometres across mountains and deserts.",
    "A triangle has three sides and three angles, and its angles always add up to one hundred and eighty degrees. A "
    "square has four equal sides and four right angles.",
    "Whales are mammals, not fish. They breathe air through a blowhole on top of their heads and feed their young "
    "with milk, just as land mammals do.",
    "Trains carry people and goods over long distances on steel rails. Many modern trains run on electricity taken "
    "from overhead wires, and the fastest ones travel at more than three hundred kilometres an hour.",
    "When you write a letter to someone you do not know well, begin politely, say clearly why you are writing, and "
    "thank them at the end for their time.",
    "The human skeleton has about two hundred and six bones in an adult. Bones protect the organs, hold the body "
    "up, and work with the muscles so that we can move.",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. When a volcano erupts it can "
    "throw out lava, ash and gas.",
    "A dictionary lists the words of a language in alphabetical order. For each word it gives the meaning, and "
    "often how to pronounce it and examples of how it is used.",
)
"""Short factual paragraphs in plain English, one subject each, written for fastkit (no copied corpus)."""

__all__ = ["GENERAL_TEXT"]
